/* One product's integer path two ways, on one core, its weights in L2: bench/amx_blocks.py
 * compiles and runs this (an Intel Xeon with AMX-INT8 only).
 *
 * A 1536 x 576 matrix in tiles of 16 rows x one 32-weight block, 4-bit weights with a scale d
 * and a minimum m per row and block (as Q4_1 in tiles.c), times R int8 rows of x with a scale dx
 * and a sum xs per block:  y[r][n] += (q . qx) (d dx) + m xs,  block by block.
 *
 * - vnni: tiles.c's way: per tile and row, 8 vpdpbusd of 16 lanes x 4 bytes.
 * - amx: the tile's nibbles unpacked to the B tile (8 rows of 16 x 4 bytes), the R rows' block
 *   of x as the A tile, one TDPBSUD per block (x signed, q unsigned), the 16 x 16 int32 result
 *   stored and scaled per row as above. Each 32-weight block has its own scales, so every
 *   block's integers must leave the tile unit before the next block: two blocks in flight.
 *
 * Both give the same floats (printed: same=1); the figures are ns per tile and row. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TILE 16
#define QK 32
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* tile: 16 d (f16 as float here), 16 m, then 4 chunks of 16x4 bytes (nibbles) */
typedef struct { float d[16], m[16]; uint8_t ch[4][64]; } Tile;
static inline __m512i dot_q4(const Tile *T, const int8_t *qb){
  const __m512i low=_mm512_set1_epi8(15); __m512i acc[4];
  for(int c=0;c<4;c++){ __m512i v=_mm512_loadu_si512(T->ch[c]);
    int32_t a,b; memcpy(&a,qb+8*c,4); memcpy(&b,qb+8*c+4,4);
    acc[c]=_mm512_dpbusd_epi32(_mm512_setzero_si512(),_mm512_and_si512(v,low),_mm512_set1_epi32(a));
    acc[c]=_mm512_dpbusd_epi32(acc[c],_mm512_and_si512(_mm512_srli_epi16(v,4),low),_mm512_set1_epi32(b));}
  return _mm512_add_epi32(_mm512_add_epi32(acc[0],acc[1]),_mm512_add_epi32(acc[2],acc[3]));
}
static void vnni(const Tile *W,int nt,int nb,const int8_t *q,const float *dx,const float *xs,float *y,int rows){
  for(int t=0;t<nt;t++){ __m512 acc[16]; for(int r=0;r<rows;r++)acc[r]=_mm512_setzero_ps();
    for(int b=0;b<nb;b++){ const Tile *T=W+(size_t)t*nb+b; __m512 d=_mm512_loadu_ps(T->d), m=_mm512_loadu_ps(T->m);
      for(int r=0;r<rows;r++){ size_t at=(size_t)r*nb+b; __m512i dot=dot_q4(T,q+at*QK);
        acc[r]=_mm512_add_ps(acc[r],_mm512_mul_ps(_mm512_cvtepi32_ps(dot),_mm512_mul_ps(d,_mm512_set1_ps(dx[at]))));
        acc[r]=_mm512_add_ps(acc[r],_mm512_mul_ps(m,_mm512_set1_ps(xs[at])));}}
    for(int r=0;r<rows;r++)_mm512_storeu_ps(y+(size_t)r*nt*16+t*16,acc[r]);}
}
static void cfg(int rows){ struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } c __attribute__((aligned(64)));
  memset(&c,0,sizeof c); c.palette=1; 
  for(int i=0;i<4;i++){c.colsb[i]=32;c.rows[i]=rows;}      /* A tiles 0-3 */
  for(int i=4;i<6;i++){c.colsb[i]=64;c.rows[i]=8;}          /* B tiles 4-5 */
  for(int i=6;i<8;i++){c.colsb[i]=64;c.rows[i]=rows;}       /* C tiles 6-7 */
  _tile_loadconfig(&c);}
static void amx(const Tile *W,int nt,int nb,const int8_t *q,const float *dx,const float *xs,float *y,int rows){
  uint8_t B[2][8][64] __attribute__((aligned(64))); int32_t C[2][16][16] __attribute__((aligned(64)));
  const __m512i low=_mm512_set1_epi8(15);
  for(int t=0;t<nt;t++){ __m512 acc[16]; for(int r=0;r<rows;r++)acc[r]=_mm512_setzero_ps();
    for(int b=0;b<nb;b+=2){
      for(int h=0;h<2;h++){ const Tile *T=W+(size_t)t*nb+b+h;
        for(int c=0;c<4;c++){ __m512i v=_mm512_loadu_si512(T->ch[c]);
          _mm512_store_si512(B[h][2*c],_mm512_and_si512(v,low)); _mm512_store_si512(B[h][2*c+1],_mm512_and_si512(_mm512_srli_epi16(v,4),low));}}
      _tile_loadd(4,B[0],64); _tile_loadd(5,B[1],64);
      _tile_loadd(0,q+(size_t)b*QK,nb*QK); _tile_loadd(1,q+(size_t)(b+1)*QK,nb*QK);
      _tile_zero(6); _tile_zero(7);
      _tile_dpbsud(6,0,4); _tile_dpbsud(7,1,5);
      _tile_stored(6,C[0],64); _tile_stored(7,C[1],64);
      for(int h=0;h<2;h++){ const Tile *T=W+(size_t)t*nb+b+h; __m512 d=_mm512_loadu_ps(T->d), m=_mm512_loadu_ps(T->m);
        for(int r=0;r<rows;r++){ size_t at=(size_t)r*nb+b+h; __m512i dot=_mm512_load_si512(C[h][r]);
          acc[r]=_mm512_add_ps(acc[r],_mm512_mul_ps(_mm512_cvtepi32_ps(dot),_mm512_mul_ps(d,_mm512_set1_ps(dx[at]))));
          acc[r]=_mm512_add_ps(acc[r],_mm512_mul_ps(m,_mm512_set1_ps(xs[at])));}}}
    for(int r=0;r<rows;r++)_mm512_storeu_ps(y+(size_t)r*nt*16+t*16,acc[r]);}
}
int main(){ if(syscall(SYS_arch_prctl,0x1023,18)){puts("no amx");return 1;}
  int N=1536,K=576,nt=N/16,nb=K/32; Tile *W=aligned_alloc(64,sizeof(Tile)*nt*nb);
  srand(1); for(size_t i=0;i<sizeof(Tile)*nt*nb;i++)((uint8_t*)W)[i]=rand();
  for(int i=0;i<nt*nb;i++)for(int j=0;j<16;j++){W[i].d[j]=(rand()%100)/100.f;W[i].m[j]=(rand()%100)/100.f;}
  int8_t *q=aligned_alloc(64,16*K); float dx[16*18],xs[16*18],*y1=malloc(4*16*N),*y2=malloc(4*16*N);
  for(int i=0;i<16*K;i++)q[i]=(rand()%255)-127; for(int i=0;i<16*nb;i++){dx[i]=(rand()%100)/100.f;xs[i]=rand()%50;}
  int rowsl[]={1,4,8,16};
  for(int ri=0;ri<4;ri++){int rows=rowsl[ri]; cfg(rows);
    vnni(W,nt,nb,q,dx,xs,y1,rows); amx(W,nt,nb,q,dx,xs,y2,rows);
    int same=memcmp(y1,y2,4*rows*N)==0;
    int R=2000; double t0=now(); for(int i=0;i<R;i++)vnni(W,nt,nb,q,dx,xs,y1,rows); double t1=now();
    for(int i=0;i<R;i++)amx(W,nt,nb,q,dx,xs,y2,rows); double t2=now();
    printf("rows %2d: vnni %.1f us  amx %.1f us  (ns per tile-row: vnni %.2f amx %.2f) same=%d\n",rows,(t1-t0)/R*1e6,(t2-t1)/R*1e6,(t1-t0)/R*1e9/(nt*nb*rows),(t2-t1)/R*1e9/(nt*nb*rows),same);}
  return 0;}
